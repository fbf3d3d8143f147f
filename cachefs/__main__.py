import sys

from cachefs.cli import main

sys.exit(main())
