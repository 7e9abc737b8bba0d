import sys

from fixed_res_sidecar.cli import main

sys.exit(main())
