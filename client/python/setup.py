"""setuptools hook for mha_serve (the metadata is in pyproject.toml): build_py also
writes the gRPC stubs, generated from ../../proto/attention.proto (or the file
MHA_SERVE_PROTO names) by grpc_tools.protoc, into the built mha_serve/_proto/.
Generated stubs are never committed."""

import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _generator():
    path = os.path.join(HERE, "mha_serve", "_proto", "_generate.py")
    spec = importlib.util.spec_from_file_location("_mha_serve_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generator = _generator()
        generator.generate(generator.default_proto(os.path.join(HERE, "mha_serve", "_proto")),
                           os.path.join(self.build_lib, "mha_serve", "_proto"))


setup(cmdclass={"build_py": BuildPyWithStubs})
