import sys

from libra.cli import main

sys.exit(main())
