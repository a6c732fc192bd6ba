//! What the benches with `--rounds` share: the median and range of the
//! rounds' figures, and JSON arrays of each round's.

/// The median, lowest and highest of some rounds' figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Spread {
    /// The middle figure; of an even count, the mean of the middle two.
    pub(crate) median: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
}

/// The spread of `values` (in any order); none of none.
pub(crate) fn spread(values: &[f64]) -> Option<Spread> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let (&min, &max) = (sorted.first()?, sorted.last()?);
    let middle = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) {
        (sorted[middle - 1] + sorted[middle]) / 2.0
    } else {
        sorted[middle]
    };
    Some(Spread { median, min, max })
}

/// The spread of `values`, or `fill` in each figure of none.
pub(crate) fn spread_or(values: impl IntoIterator<Item = f64>, fill: f64) -> Spread {
    let values: Vec<f64> = values.into_iter().collect();
    spread(&values).unwrap_or(Spread {
        median: fill,
        min: fill,
        max: fill,
    })
}

/// `values` as a JSON array.
pub(crate) fn json_array<T>(
    values: impl IntoIterator<Item = T>,
    each: impl Fn(T) -> String,
) -> String {
    let items: Vec<String> = values.into_iter().map(each).collect();
    format!("[{}]", items.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The median is the middle figure (of an even count, the mean of the
    /// middle two), not the mean or the first round's; none of none.
    #[test]
    fn a_spread_is_the_median_and_the_range_of_the_figures() {
        let odd = spread(&[40.0, 10.0, 20.0]).unwrap();
        assert_eq!((odd.median, odd.min, odd.max), (20.0, 10.0, 40.0));
        let even = spread(&[4.0, 1.0, 3.0, 100.0]).unwrap();
        assert_eq!((even.median, even.min, even.max), (3.5, 1.0, 100.0));
        assert_eq!(spread(&[7.0]).map(|s| s.median), Some(7.0));
        assert_eq!(spread(&[]), None);
    }
}
