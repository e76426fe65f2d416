"""The checkpoint format: the files a run writes and the typed record of what it stores."""
