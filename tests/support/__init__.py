"""Test support: fakes and harnesses the tests share (a fake clock, the served-engine harness)."""
