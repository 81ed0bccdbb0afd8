import sys

from loraplex.cli import main

sys.exit(main())
