"""AFD role workers. `roles` holds the platform-neutral role logic (connector set-up, the
per-step control message, the FFN serving loop); each platform's worker module binds it to
that platform's vLLM worker class. `selection` maps a role and platform to a worker class."""
