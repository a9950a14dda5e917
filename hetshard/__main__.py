import sys

from hetshard.cli import main

sys.exit(main())
