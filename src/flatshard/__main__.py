import sys

from flatshard.cli import main

sys.exit(main())
