import sys

from kvstore.cli import main

sys.exit(main())
