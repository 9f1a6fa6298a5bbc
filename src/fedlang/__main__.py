"""`python -m fedlang ...`: the same as the `fedlang` command."""

from fedlang.cli import main

if __name__ == "__main__":
    main()
