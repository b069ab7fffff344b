import sys

from ckptlab.cli import main

sys.exit(main())
