"""A module that starts a thread on import: preloading it makes forking unsafe."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
