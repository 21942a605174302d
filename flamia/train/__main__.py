"""python -m flamia.train [options]: see flamia/train/__init__.py."""
import sys

from . import main

sys.exit(main())
