"""atoll.coordinator: the coordinator service, membership, store, islands, planner and simulator."""
