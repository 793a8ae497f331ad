import sys

from ds_lowcomm.configs import main

sys.exit(main())
