"""atoll.coordinator.planner: islands, slices and balanced pipelines (the Tangram decomposition)."""
