#![allow(dead_code)]

#[derive(shardline_derive::Entity)]
#[shardline(table = "photos")]
struct Photo {
    id: shardline_repo::Id,
    #[shardline(user)]
    user_id: i64,
    url: String,
}

// Every insert would fail at run time (42701, column specified more than once).
#[derive(shardline_derive::NewRow)]
#[shardline(entity = Photo)]
struct NewPhoto {
    #[shardline(user)]
    user_id: i64,
    #[shardline(column = "url")]
    link: String,
    url: String,
}

fn main() {}
