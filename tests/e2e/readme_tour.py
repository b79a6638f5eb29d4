#!/usr/bin/env python3
"""The README's set-up and five-minute tour, run as written from a fresh clone.

    readme_tour.py SOURCE_DIR [--keep] [--sections=1,2,...] [--build_from=DIR] [--dry_run]

Clones SOURCE_DIR (its committed HEAD) into a temporary directory, runs the set-up
command of "Set-up in two commands" there (scripts/deps.sh, configure, build: tens of
minutes on a small machine; CMAKE_CXX_COMPILER_LAUNCHER=ccache in the environment
speeds a rebuild), then every ```sh and ```python block of "A five-minute tour" in
order, each block in one bash (set -e -o pipefail; `S=` and `C=` carry over) or in the
tour's venv's python (V/bin/python, made in step 4). A block that fails fails the
test, naming the step and printing its output.

The README's prose asks for things its blocks do not do; the script does them, and
nothing else:
  - a server command (a line that runs $S or attention_server) is started in the
    background, waited for until it prints "listening on", and left running until the
    next one; in step 1, which shows three ways to start it, each is stopped again;
  - steps 2-4 run against `$S` with no arguments ("against attention_server with no
    arguments"; started again for each step, so that --sections can pick any), step 5
    against `$S --model_repository=deploy/models` ("Start the
    server on deploy/models"), steps 6 and 7 against the server step 6 starts;
  - step 8 (docker, docker compose, kubectl) is not run: printed as skipped.
The tour binds the default ports (50051, 8000, 9464): they must be free.

Slow: skipped (exit 77) unless MHA_SLOW_TESTS=1 (ctest label slow; out of CI).
--build_from=DIR links DIR (an existing build/release) into the clone instead of
building, to check the tour quickly; --sections runs only those steps ("0" is the
set-up); --dry_run prints each block's script without running it; --keep keeps the
clone.
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

SERVER_LINE = re.compile(r"^(\$S|\S*attention_server)(\s.*)?$")
ASSIGNMENT = re.compile(r"^[A-Z]\w*=\S+$")
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)

# What each step's prose asks of the server before its blocks run (see above); steps
# not listed keep the server the one before left running.
SERVER_BEFORE = {
    "2": "$S",
    "3": "$S",
    "4": "$S",
    "5": "$S --model_repository=deploy/models",
    "6": None,  # stop: step 6 starts its own
}

# Shell functions every block's bash gets: start a server in the background and wait
# for it to listen (the one before stopped first), stop the current one.
PRELUDE = r"""
tour_stop() {
  local -; set +x
  [[ -s "$TOUR_DIR/server.pid" ]] || return 0
  local pid; pid=$(cat "$TOUR_DIR/server.pid"); : > "$TOUR_DIR/server.pid"
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  echo "tour: server $pid did not exit 30 s after SIGTERM" >&2; kill -9 "$pid"; return 1
}
tour_server() {
  local -; set +x
  tour_stop
  local log="$TOUR_DIR/server.$RANDOM.log"
  echo "tour: starting $* (log $log)" >&2
  "$@" > "$log" 2>&1 &
  echo $! > "$TOUR_DIR/server.pid"
  for _ in $(seq 1200); do
    if grep -q "listening on" "$log"; then cat "$log" >&2; return 0; fi
    kill -0 "$(cat "$TOUR_DIR/server.pid")" 2>/dev/null || { cat "$log" >&2; return 1; }
    sleep 0.1
  done
  echo "tour: $* did not print 'listening on' in 120 s" >&2; cat "$log" >&2; return 1
}
"""


def sections(readme):
    """[(step, title, [(language, code)])]: step "0" is the set-up's first block, then
    the tour's steps "1".."8"."""
    setup = readme.split("## Set-up in two commands", 1)[1].split("\n## ", 1)[0]
    steps = [("0", "Set-up", BLOCK.findall(setup)[:1])]
    tour = readme.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    for part in re.split(r"^### ", tour, flags=re.M)[1:]:
        title = part.split("\n", 1)[0]
        step = title.split(".", 1)[0]
        steps.append((step, title, BLOCK.findall(part)))
    return steps


def shell_script(step, code, assignments):
    """The block as bash: server lines started in the background (and, in steps 0
    and 1, stopped again); a trailing ' &' on a server line is the background."""
    lines = []
    for line in code.rstrip("\n").split("\n"):
        command = line.split("  #", 1)[0].rstrip()
        if ASSIGNMENT.match(command):
            assignments.append(command)
            lines.append(line)
            continue
        # The set-up's one line ends by starting the server.
        if step == "0" and "&& ./build/release/server/attention_server" in command:
            build, server = command.split("&& ./build/release/server/attention_server", 1)
            lines += [build.rstrip(), f"tour_server ./build/release/server/attention_server{server}",
                      "tour_stop"]
            continue
        if SERVER_LINE.match(command.rstrip("&").strip()):
            lines.append(f"tour_server {command.rstrip('&').strip()}")
            if step == "1":
                lines.append("tour_stop")
            continue
        lines.append(line)
    return "\n".join(lines) + "\n"


def run(script, cwd, env, what, dry_run, interpreter=("bash",), prelude=""):
    """Runs `script` (after `prelude`, not printed); exits naming `what` if it fails."""
    print(f"=== {what}\n{script}", flush=True)
    if dry_run:
        return
    done = subprocess.run([*interpreter, "-c", prelude + script], cwd=cwd, env=env,
                          stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    print(done.stdout, flush=True)
    if done.returncode != 0:
        sys.exit(f"readme_tour: FAILED at {what}: exit {done.returncode}")


def port_in_use(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("source_dir")
    parser.add_argument("--sections", default="", help="comma-separated steps; default: all")
    parser.add_argument("--build_from", default="", help="an existing build/release to link")
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if os.environ.get("MHA_SLOW_TESTS") != "1" and not args.dry_run:
        print("readme_tour: skipped (slow; MHA_SLOW_TESTS=1 runs it)")
        return 77
    if not args.dry_run:
        busy = [p for p in (50051, 8000, 9464) if port_in_use(p)]
        if busy:
            sys.exit(f"readme_tour: ports {busy} are in use; the tour needs the defaults free")

    top = tempfile.mkdtemp(prefix="mha_tour.")
    clone = os.path.join(top, "mha-serve")
    env = dict(os.environ, TOUR_DIR=top)
    env.pop("PYTHONPATH", None)
    selected = set(filter(None, args.sections.split(",")))
    try:
        subprocess.run(["git", "clone", "--quiet", args.source_dir, clone], check=True)
        with open(os.path.join(clone, "README.md"), encoding="utf-8") as f:
            steps = sections(f.read())
        if args.build_from:
            os.makedirs(os.path.join(clone, "build"))
            os.symlink(os.path.abspath(args.build_from), os.path.join(clone, "build", "release"))
            selected = selected or {s for s, _, _ in steps if s != "0"}
        assignments = []
        for step, title, blocks in steps:
            if selected and step not in selected:
                for language, code in blocks:  # keep S= and C= for the steps selected
                    if language == "sh":
                        shell_script(step, code, assignments)
                continue
            if step == "8":
                print(f"=== step 8 ({title}): skipped (docker, docker compose, kubectl)")
                continue
            prelude = PRELUDE + "\n".join(assignments) + "\nset -e -o pipefail\n"
            if step in SERVER_BEFORE:
                server = SERVER_BEFORE[step]
                run(f"tour_server {server}\n" if server else "tour_stop\n", clone, env,
                    f"step {step} ({title}): the server its prose asks for", args.dry_run,
                    prelude=prelude)
            for i, (language, code) in enumerate(blocks):
                what = f"step {step} ({title}), block {i + 1} ({language})"
                if language == "sh":
                    prelude = PRELUDE + "\n".join(assignments) + "\nset -e -o pipefail\n"
                    script = shell_script(step, code, assignments)
                    run(script, clone, env, what, args.dry_run, prelude=prelude + "set -x\n")
                elif language == "python":
                    run(code, clone, env, what, args.dry_run, interpreter=("V/bin/python",))
                else:
                    print(f"=== {what}: not a command (shown output or a file), not run")
        print("readme_tour: passed" if not args.dry_run else "readme_tour: dry run")
        return 0
    finally:
        if not args.dry_run:
            subprocess.run(["bash", "-c", PRELUDE + "tour_stop"], env=env, check=False)
        if args.keep:
            print(f"readme_tour: kept {clone}")
        else:
            shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
