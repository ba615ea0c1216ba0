"""``python -m libra.emulation``: serve an emulated vLLM server (see ``--help``)."""

from libra.emulation._serve import main

if __name__ == "__main__":
    main()
