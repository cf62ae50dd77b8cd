"""Wake-ups: how a worker learns of a new or handed-back task sooner than its poll (NOTIFY, publish, file versions)."""
