import sys

from torchpmap.bench.gpu_check.cli import main

sys.exit(main())
