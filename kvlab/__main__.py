import sys

from kvlab.cli import main

sys.exit(main())
