# A notebook cell as IPython runs one, without IPython: `python notebook_cell.py CELL` execs the
# file CELL in this script's namespace, compiled under a cell's name, so what the cell defines
# (a Dataset class) belongs to __main__ but is not in this file (tests/test_run_modes.py).
import __main__
import sys

if __name__ == "__main__":
    with open(sys.argv[1]) as cell:
        source = cell.read()
    exec(compile(source, "<ipython-input-1>", "exec"), vars(__main__))
