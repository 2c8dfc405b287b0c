"""``python -m bench.gpu_check``: the GPU check's driver (bench/gpu_check/check.py)."""

import sys

from bench.gpu_check.check import main

sys.exit(main())
