"""``python -m realloc``: the ``realloc`` program, for an environment whose scripts are not on PATH."""

from realloc.cli import entry

if __name__ == "__main__":
    entry()
