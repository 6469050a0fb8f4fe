"""Built-in example text: short paragraphs of variable-length sentences."""

PARAGRAPHS = (
  (
    "The river rose overnight.",
    "By morning the lower fields were under a sheet of brown water that "
    "reached the fence posts and kept climbing.",
    "Nobody spoke.",
  ),
  (
    "Sequences come in every length.",
    "A speech clip may last two seconds or two minutes, a sentence may hold "
    "three words or forty, and a gene may span a few hundred bases or many "
    "thousands.",
    "Padding them all to the longest one wastes most of the work.",
    "Sorting them by length lets the batch shrink as short ones end.",
  ),
  (
    "She counted the steps twice.",
    "Seven.",
    "Then she opened the door, looked at the empty hallway for a long "
    "moment, and closed it again without a sound.",
  ),
)
