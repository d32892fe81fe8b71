"""Model families over packed token streams, one file per family."""
