import sys

from groundtune.cli import main

sys.exit(main())
