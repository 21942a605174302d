"""`python -m flamia ...` is the `flamia` command."""
from .cli import main

raise SystemExit(main())
