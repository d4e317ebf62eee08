import sys

from megatron_vlm_packing.cli import main

sys.exit(main())
