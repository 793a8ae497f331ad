import sys

from ds_lowcomm.checkpoint.export import main

sys.exit(main())
