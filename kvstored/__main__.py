import sys

from kvstored.cli import main

sys.exit(main())
