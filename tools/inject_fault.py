"""Send a fault to a running ntp_ds job: the same as `ntp-ds inject` (see `ntp_ds.control.inject`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_ds.control.inject import main

if __name__ == "__main__":
    sys.exit(main())
