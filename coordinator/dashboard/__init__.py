"""The coordinator's read-only web dashboard: an aiohttp server beside the gRPC one (`server`), the snapshot of
the job it shows (`snapshot`), the events it lists (`events`), its viewer token (`access`) and the page itself
(`static/`, shipped in the wheel)."""
