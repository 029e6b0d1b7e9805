//! Plain-text tables: columns padded to their widest cell, two spaces apart.

pub fn render(columns: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = columns.iter().map(|c| c.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let header: Vec<String> = columns.iter().map(|c| c.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, w))| match i + 1 == row.len() {
                true => cell.clone(),
                false => format!("{cell:<w$}"),
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up() {
        let rows = vec![
            vec!["a".to_string(), "long cell".into()],
            vec!["bbb".into(), "c".into()],
        ];
        assert_eq!(super::render(&["X", "Y"], &rows), "X    Y\na    long cell\nbbb  c\n");
    }
}
