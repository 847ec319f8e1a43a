import sys

from lora_merge.entry import main

sys.exit(main())
