"""``python -m producer``: see ``producer.cli``."""

import sys

from producer.cli import main

sys.exit(main())
