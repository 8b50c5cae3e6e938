"""What every test process needs before its first test: the test backend that NTP_TEST_BACKEND names, registered
with torch (the ranks the tests spawn register it themselves)."""

from ntp_ds.testing import register_test_backend

register_test_backend()
