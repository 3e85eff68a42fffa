#![allow(dead_code)]

#[derive(shardline_derive::Entity)]
#[shardline(table = "photo s")]
struct Spaced {
    id: i64,
}

#[derive(shardline_derive::Entity)]
#[shardline(table = "photos\" (url) VALUES ('x'); DROP TABLE users; --")]
struct Quoted {
    id: i64,
}

fn main() {}
