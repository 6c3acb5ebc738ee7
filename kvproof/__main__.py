import sys

from kvproof.cli.main import main

sys.exit(main())
