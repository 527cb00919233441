"""`python -m tidal.bench ...` == `tidal bench ...`."""

from tidal.bench.serving import main

if __name__ == "__main__":
    main()
