import sys

from lora_merge.cli import main

sys.exit(main())
