"""``python -m tests.programs.kernel_cell CELL``: run the file CELL as one cell of a real
Jupyter kernel (ipykernel, started and driven by jupyter_client as a notebook server
does, in this process's environment) and echo what the cell wrote: its stdout here, its
stderr to stderr. Exits 1 if the cell raised (its traceback on stderr), 0 otherwise."""

import os
import sys

from jupyter_client.manager import KernelManager


def main(cell: str) -> int:
    with open(cell) as source:
        code = source.read()
    manager = KernelManager(kernel_name="python3", transport="ipc")
    manager.start_kernel(env=dict(os.environ), cwd=os.getcwd())
    client = manager.client()
    client.start_channels()
    failed = False

    def echo(message):
        nonlocal failed
        kind, content = message["msg_type"], message["content"]
        if kind == "stream":
            (sys.stdout if content["name"] == "stdout" else sys.stderr).write(content["text"])
        elif kind == "error":
            failed = True
            sys.stderr.write("\n".join(content["traceback"]) + "\n")

    try:
        client.wait_for_ready(timeout=120)
        reply = client.execute_interactive(code, timeout=150, output_hook=echo)
        failed = failed or reply["content"]["status"] != "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
