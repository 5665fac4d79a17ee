"""``python -m twin``: the ``twin`` command, run from a source tree with nothing installed."""

from twin.cli import main

if __name__ == "__main__":
    main()
