import sys

from flatshard.app.cli import main

sys.exit(main())
