"""The built-in held-out text `dflash2 validate` scores perplexity and KL divergence on (written for this
project, so no calibration set or training corpus holds it verbatim)."""

EVAL_TEXT = """\
The lighthouse on the northern cape was built in 1871, after a winter in which three ships were lost on the
rocks within sight of the harbor. For nearly a century a keeper and his family lived in the small stone house
at its base. Every evening the keeper climbed the spiral stairs, trimmed the wick, polished the great lens and
wound the clockwork that turned it. The light could be seen twenty miles out to sea, and sailors said that
its slow white flash was the most welcome sight on the whole coast.

Life at the station followed the weather. In calm months the keeper's children walked two miles along the
cliff path to the village school, and supplies came by cart once a week. When storms closed the road, the
family lived on salted fish, potatoes from their garden and bread baked in the kitchen stove. The logbook,
which still survives in the county archive, records each passing ship, each change in the wind and, now and
then, a short personal note: "Fog all day. The baby took her first steps."

In 1962 the light was automated. An electric lamp replaced the oil burner, a motor replaced the clockwork,
and the last keeper moved to a house in the village. For a while the building stood empty, its windows
boarded against the wind. Then a group of volunteers formed a trust, repaired the roof and opened the tower
to visitors. Today children climb the same stairs the keeper climbed, and on clear evenings the old lens,
cleaned and restored, catches the sunset and throws it back across the water.

Scientists who study memory have long been interested in why some events stay with us for decades while
others fade within days. One explanation is that the brain strengthens connections that are used often and
prunes those that are not. Sleep appears to play a central role: during deep sleep, patterns of activity
recorded during the day are replayed, and the connections that support them are reinforced. Experiments
with students show that those who sleep after learning a list of words remember more of it the next morning
than those who stay awake for the same number of hours.

Emotion also matters. Events that frighten or delight us are remembered more vividly, partly because
stress hormones signal to the brain that something important has happened. This is useful in the wild,
where remembering the location of a predator or a source of water can mean the difference between life and
death. It can be less useful in modern life, where a single embarrassing moment may be replayed for years
while the details of an ordinary but pleasant afternoon are quickly lost.

To make a simple vegetable soup, start by chopping one onion, two carrots and two sticks of celery into
small pieces. Warm a spoonful of olive oil in a large pot over medium heat and cook the vegetables for about
ten minutes, stirring now and then, until they are soft but not brown. Add a chopped clove of garlic, a
diced potato and a can of tomatoes, then pour in a liter of stock. Bring the soup to a gentle boil, lower the
heat and let it simmer for twenty minutes. Season with salt and pepper, add a handful of spinach at the end,
and serve with fresh bread.

A program that sorts a list of numbers can be written in many ways. The simplest approach compares each pair
of neighboring elements and swaps them when they are out of order, repeating until no swaps are needed.
This works, but it becomes slow as the list grows, because the number of comparisons rises with the square
of the length. Faster methods divide the list into smaller parts, sort each part, and then merge the results.
Merge sort and quicksort both follow this idea, and on large inputs they finish in a small fraction of the
time.

The town council met on Tuesday to discuss the plan for a new bridge over the river. Supporters argued that
the old bridge, built more than eighty years ago, was too narrow for modern traffic and that repairs were
becoming more expensive every year. Opponents worried about the cost and about the noise that construction
would bring to the houses along the bank. After three hours of debate the council agreed to ask engineers
for a detailed report on both options and to hold a public meeting before making a final decision.
"""
