"""`python -m specserve_operator` is the `specserve` command."""

import sys

from specserve_operator.cli import main

sys.exit(main())
