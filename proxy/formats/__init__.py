"""Wire formats read into the pipeline's message model and written back, changing only what the
pipeline changed: :mod:`.chat` (chat completions); :mod:`.json` splices raw JSON, :mod:`.body`
holds the checks every format shares."""
