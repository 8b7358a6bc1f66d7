"""Cost estimation: hardware specs, profile tables, time, memory and reallocation cost."""
