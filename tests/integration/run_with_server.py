#!/usr/bin/python3
"""Runs a command against a fresh attention_server: every "{target}" in the
command becomes its HOST:PORT. Exits with the command's code, or 1 if the server
does not stop cleanly.

    run_with_server.py SERVER_BINARY [server flags...] -- COMMAND...
"""

import subprocess
import sys

from server_harness import start_server, stop_server


def main():
    split = sys.argv.index("--")
    binary, server_args, command = sys.argv[1], sys.argv[2:split], sys.argv[split + 1:]
    proc, target = start_server(binary, server_args)
    try:
        code = subprocess.call([part.replace("{target}", target) for part in command],
                               timeout=120)
    finally:
        stopped = stop_server(proc)
    return code if code != 0 else (0 if stopped == 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
