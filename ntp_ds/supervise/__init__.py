"""Process supervision, shared by `ntp-ds launch` (launch.py), the sentinel in front of a worker that another launcher
started (sentinel.py), the test spawner (`ntp_ds.testing.spawn`) and `ntp-ds train`: forking workers from a process
that imported the training code once (forked.py) and the stop signals a job agrees on (stop.py)."""
