//! A ustar writer that records nothing of the machine it runs on: every entry has uid/gid 0, no
//! user or group names and the same mtime, so equal inputs give equal bytes. Entries are
//! directories, regular files and symbolic links.

use std::io::{self, Write};

const BLOCK: usize = 512;

/// What an entry is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File(Vec<u8>),
    /// A symbolic link to this target (as written: relative or absolute, at most 100 bytes).
    Symlink(String),
}

/// Writes ustar entries to `W` in the order they are appended; [`TarWriter::finish`] writes the
/// end-of-archive blocks.
pub struct TarWriter<W: Write> {
    out: W,
    mtime: u64,
}

impl<W: Write> TarWriter<W> {
    pub fn new(out: W, mtime: u64) -> Self {
        Self { out, mtime }
    }

    /// A directory entry (`path` without a trailing slash; one is added).
    pub fn append_dir(&mut self, path: &str, mode: u32) -> io::Result<()> {
        let header = header(&format!("{path}/"), mode, 0, self.mtime, b'5', "")?;
        self.out.write_all(&header)
    }

    /// A symbolic link entry (typeflag `2`, no data): `path` pointing at `target`.
    pub fn append_symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        let header = header(path, 0o777, 0, self.mtime, b'2', target)?;
        self.out.write_all(&header)
    }

    /// A regular file entry and its data, padded to a block.
    pub fn append_file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        let header = header(path, mode, data.len() as u64, self.mtime, b'0', "")?;
        self.out.write_all(&header)?;
        self.out.write_all(data)?;
        let pad = (BLOCK - data.len() % BLOCK) % BLOCK;
        self.out.write_all(&[0; BLOCK][..pad])
    }

    pub fn append(&mut self, path: &str, mode: u32, kind: &Kind) -> io::Result<()> {
        match kind {
            Kind::Dir => self.append_dir(path, mode),
            Kind::File(data) => self.append_file(path, mode, data),
            Kind::Symlink(target) => self.append_symlink(path, target),
        }
    }

    /// The two zero blocks that end an archive; returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(&[0; 2 * BLOCK])?;
        Ok(self.out)
    }
}

/// A ustar header block. Names longer than 100 bytes are split into prefix and name at a `/`;
/// `link` (a symlink's target, else empty) must fit its 100-byte field.
fn header(
    path: &str,
    mode: u32,
    size: u64,
    mtime: u64,
    typeflag: u8,
    link: &str,
) -> io::Result<[u8; BLOCK]> {
    let mut h = [0u8; BLOCK];
    if link.len() > 100 || link.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("tar: link target too long for ustar: {path} -> {link}"),
        ));
    }
    let (prefix, name) = split_name(path).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("tar: path too long for ustar: {path}"),
        )
    })?;
    h[..name.len()].copy_from_slice(name.as_bytes());
    octal(&mut h[100..108], u64::from(mode & 0o7777));
    octal(&mut h[108..116], 0); // uid
    octal(&mut h[116..124], 0); // gid
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], mtime);
    h[156] = typeflag;
    h[157..157 + link.len()].copy_from_slice(link.as_bytes());
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0); // devmajor
    octal(&mut h[337..345], 0); // devminor
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    // The checksum is computed with its own field read as spaces.
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    octal(&mut h[148..155], u64::from(sum));
    h[155] = b' ';
    Ok(h)
}

/// (prefix, name) with name ≤ 100 and prefix ≤ 155 bytes, or None.
fn split_name(path: &str) -> Option<(&str, &str)> {
    if path.len() <= 100 {
        return Some(("", path));
    }
    // The rightmost `/` leaving a name that fits, not counting a directory's trailing slash.
    let body = path.strip_suffix('/').unwrap_or(path);
    body.char_indices()
        .filter(|&(i, c)| c == '/' && path.len() - i - 1 <= 100 && i <= 155)
        .map(|(i, _)| (&path[..i], &path[i + 1..]))
        .next()
}

/// Zero-padded octal digits filling all but the last byte of `field`, which is NUL.
fn octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    field[..digits].copy_from_slice(&text.as_bytes()[text.len() - digits..]);
    field[digits] = 0;
}

#[cfg(test)]
pub(crate) mod read {
    //! A minimal ustar reader for the tests: each entry's header fields, with its checksum
    //! verified.

    #[derive(Debug, PartialEq, Eq)]
    pub struct Entry {
        pub path: String,
        pub mode: u32,
        pub uid: u64,
        pub gid: u64,
        pub mtime: u64,
        pub typeflag: u8,
        /// A symlink's target (empty for other entries).
        pub link: String,
        pub uname: String,
        pub data: Vec<u8>,
    }

    fn field(b: &[u8]) -> String {
        String::from_utf8_lossy(b.split(|&c| c == 0).next().unwrap_or_default()).into_owned()
    }

    fn num(b: &[u8]) -> u64 {
        u64::from_str_radix(field(b).trim(), 8).expect("octal field")
    }

    pub fn entries(tar: &[u8]) -> Vec<Entry> {
        assert_eq!(tar.len() % 512, 0, "not whole blocks");
        let mut out = Vec::new();
        let mut at = 0;
        while at + 512 <= tar.len() {
            let h = &tar[at..at + 512];
            if h.iter().all(|&b| b == 0) {
                assert!(tar[at..].iter().all(|&b| b == 0), "data after the end");
                assert!(tar.len() - at >= 1024, "two end blocks");
                return out;
            }
            let mut check = h.to_vec();
            check[148..156].fill(b' ');
            let sum: u64 = check.iter().map(|&b| u64::from(b)).sum();
            assert_eq!(num(&h[148..155]), sum, "checksum of entry at {at}");
            let size = num(&h[124..136]) as usize;
            let prefix = field(&h[345..500]);
            let name = field(&h[..100]);
            let path = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            out.push(Entry {
                path,
                mode: num(&h[100..108]) as u32,
                uid: num(&h[108..116]),
                gid: num(&h[116..124]),
                mtime: num(&h[136..148]),
                typeflag: h[156],
                link: field(&h[157..257]),
                uname: field(&h[265..297]),
                data: tar[at + 512..at + 512 + size].to_vec(),
            });
            at += 512 + size.div_ceil(512) * 512;
        }
        panic!("no end-of-archive blocks");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_back_with_root_owner_and_the_given_mtime() {
        let mut w = TarWriter::new(Vec::new(), 42);
        w.append_dir("usr", 0o755).unwrap();
        w.append_file("usr/a", 0o644, b"hello").unwrap();
        let long = format!("{}/{}", "d".repeat(120), "f".repeat(90));
        w.append_file(&long, 0o755, &[7; 600]).unwrap();
        let bytes = w.finish().unwrap();
        let got = read::entries(&bytes);
        let paths: Vec<&str> = got.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["usr/", "usr/a", long.as_str()]);
        assert_eq!(got[1].data, b"hello");
        assert_eq!(got[2].data, vec![7; 600]);
        assert_eq!(got[2].mode, 0o755);
        for e in &got {
            assert_eq!((e.uid, e.gid, e.mtime, e.uname.as_str()), (0, 0, 42, ""));
        }
    }

    #[test]
    fn symlinks_read_back_with_their_target_and_no_data() {
        let mut w = TarWriter::new(Vec::new(), 7);
        w.append_file("usr/sbin/xtables-nft-multi", 0o755, b"elf")
            .unwrap();
        w.append(
            "usr/sbin/iptables-nft-save",
            0o755,
            &Kind::Symlink("xtables-nft-multi".into()),
        )
        .unwrap();
        w.append_symlink("lib/abs", "/usr/lib/x").unwrap();
        let bytes = w.finish().unwrap();
        let got = read::entries(&bytes);
        let link = &got[1];
        assert_eq!(
            (
                link.path.as_str(),
                link.typeflag,
                link.link.as_str(),
                link.mode
            ),
            (
                "usr/sbin/iptables-nft-save",
                b'2',
                "xtables-nft-multi",
                0o777
            )
        );
        assert!(link.data.is_empty());
        assert_eq!((link.uid, link.gid, link.mtime), (0, 0, 7));
        assert_eq!(
            (got[2].typeflag, got[2].link.as_str()),
            (b'2', "/usr/lib/x")
        );
        assert_eq!(got[0].link, "");
        let mut w = TarWriter::new(Vec::new(), 0);
        assert!(w.append_symlink("a", &"t".repeat(101)).is_err());
    }

    #[test]
    fn a_name_that_cannot_be_split_is_an_error() {
        let mut w = TarWriter::new(Vec::new(), 0);
        assert!(w.append_file(&"x".repeat(101), 0o644, b"").is_err());
    }
}
