"""The lock for any code: ``Mutex``, its held lease and renewer thread, the acquire loop."""
