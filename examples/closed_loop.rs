//! A closed-loop HTTP/1.1 load client for bench/tail.sh: `connections` keep-alive
//! connections on one thread, each sending its next request as soon as it has read the
//! last response, for `seconds`. Where wrk prints a latency histogram, this prints every
//! request (connection, start in µs from the run's start, latency in µs), so that the
//! driver can tell a slow request that shared its moment with the others of one worker
//! (that worker stopped) from one that shared it with every connection (the client
//! stopped).
//!
//! Usage: closed_loop ADDR CONNECTIONS SECONDS REQUEST, REQUEST with `\r\n` written out.
//! Responses are framed by Content-Length only, which is what the bench's upstream sends.

use std::io::Write;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, connections, seconds, request] = &args[..] else {
        return Err("usage: closed_loop ADDR CONNECTIONS SECONDS REQUEST".into());
    };
    let request = request.replace("\\r\\n", "\r\n").into_bytes();
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds.parse()?);
    let mut runs = Vec::new();
    for _ in 0..connections.parse::<usize>()? {
        let (addr, request) = (addr.clone(), request.clone());
        runs.push(tokio::spawn(async move {
            exchange_until(&addr, &request, start, end).await
        }));
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for (conn, run) in runs.into_iter().enumerate() {
        for (at, latency) in run.await?? {
            writeln!(out, "{conn} {at} {latency}")?;
        }
    }
    Ok(())
}

/// One connection's requests until `end`: (start, latency) in µs.
async fn exchange_until(
    addr: &str,
    request: &[u8],
    start: Instant,
    end: Instant,
) -> Result<Vec<(u128, u128)>, Error> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let mut done = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut have = 0;
    while Instant::now() < end {
        let sent = Instant::now();
        stream.write_all(request).await?;
        loop {
            if let Some(len) = response_len(&buf[..have])?
                && have >= len
            {
                buf.copy_within(len..have, 0);
                have -= len;
                break;
            }
            if have == buf.len() {
                return Err("a response larger than the buffer".into());
            }
            let n = stream.read(&mut buf[have..]).await?;
            if n == 0 {
                return Err("the server closed the connection".into());
            }
            have += n;
        }
        done.push(((sent - start).as_micros(), sent.elapsed().as_micros()));
    }
    Ok(done)
}

/// The length of the response at the front of `buf` (head and body) once its head is
/// complete.
fn response_len(buf: &[u8]) -> Result<Option<usize>, Error> {
    let Some(head_end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..head_end])?;
    let mut body = 0;
    for line in head.lines().skip(1) {
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("content-length")
        {
            body = value.trim().parse()?;
        }
    }
    Ok(Some(head_end + 4 + body))
}
