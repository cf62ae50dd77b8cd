"""What a node tells about itself: Prometheus metrics and their instruments, the HTTP endpoints, pings, clock offset."""
